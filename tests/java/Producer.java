// The official Apache Kafka Java producer, as an independent source of records for the codec tests.
// Run as a single-file program (Java 11+): java -cp '<kafka libs>/*' Producer.java BOOTSTRAP TOPIC CODEC FILE
// FILE holds one record per line: the key, a TAB, the value (UTF-8, no TAB or newline inside either).
// Prints "sent=N compression-rate-avg=R" (R < 1 when the producer really compressed its batches).

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.Future;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.Metric;
import org.apache.kafka.common.MetricName;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public class Producer {
    public static void main(String[] args) throws Exception {
        if (args.length != 4) {
            System.err.println("usage: Producer BOOTSTRAP TOPIC CODEC FILE");
            System.exit(2);
        }
        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        props.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, args[2]);
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        props.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        // Batches of many records: compression applies per batch, so several records share one compressed batch.
        props.put(ProducerConfig.LINGER_MS_CONFIG, "50");
        props.put(ProducerConfig.BATCH_SIZE_CONFIG, "65536");
        props.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, "20000");  // a missing topic fails fast, not after 60 s
        props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        List<String> lines = Files.readAllLines(Path.of(args[3]), StandardCharsets.UTF_8);
        try (KafkaProducer<byte[], byte[]> producer = new KafkaProducer<>(props)) {
            List<Future<RecordMetadata>> sent = new ArrayList<>();
            for (String line : lines) {
                int tab = line.indexOf('\t');
                byte[] key = line.substring(0, tab).getBytes(StandardCharsets.UTF_8);
                byte[] value = line.substring(tab + 1).getBytes(StandardCharsets.UTF_8);
                sent.add(producer.send(new ProducerRecord<>(args[1], key, value)));
            }
            producer.flush();
            for (Future<RecordMetadata> f : sent) {
                f.get();  // any failed send fails the program
            }
            double rate = Double.NaN;
            for (java.util.Map.Entry<MetricName, ? extends Metric> e : producer.metrics().entrySet()) {
                if (e.getKey().name().equals("compression-rate-avg") && e.getKey().group().equals("producer-metrics")) {
                    rate = ((Number) e.getValue().metricValue()).doubleValue();
                }
            }
            System.out.println("sent=" + sent.size() + " compression-rate-avg=" + rate);
        }
    }
}
