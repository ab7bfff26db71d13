import java.util.Properties;
import org.apache.kafka.clients.producer.*;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public class FastProducer {
    public static void main(String[] a) throws Exception {
        Properties p = new Properties();
        p.put("bootstrap.servers", a[0]);
        p.put("acks", "1");
        p.put("linger.ms", "20");
        p.put("batch.size", String.valueOf(1 << 20));
        p.put("buffer.memory", String.valueOf(64 << 20));
        p.put("enable.idempotence", "false");
        p.put("key.serializer", ByteArraySerializer.class.getName());
        p.put("value.serializer", ByteArraySerializer.class.getName());
        long n = Long.parseLong(a[2]);
        int parts = Integer.parseInt(a[3]);
        byte[] v = new byte[8];
        try (KafkaProducer<byte[], byte[]> prod = new KafkaProducer<>(p)) {
            for (long i = 0; i < n; i++) prod.send(new ProducerRecord<>(a[1], (int) (i % parts), null, v));
            prod.flush();
        }
    }
}
