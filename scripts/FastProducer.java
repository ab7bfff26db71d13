// A load generator for python -m scripts.bench soak and verify (scripts/benchmarks/soak.py), run as a single-file source with the project's Kafka jars:
//   java -cp '<kafka libs>/*' scripts/FastProducer.java BOOTSTRAP TOPIC COUNT PARTITIONS [RATE | sparse]
// Without RATE: COUNT tiny records round robin over PARTITIONS, as fast as possible (verify reads offsets only).
// With RATE: COUNT valid movements (keyed by SKU) at a steady RATE per second, paced every millisecond; a Python
// producer on a busy machine falls behind and stamps records long before it sends them, which is not the ledger's
// latency.
// With "sparse": COUNT valid movements as fast as possible, one record per record batch: the log a steady, modest
// rate leaves (the soak's), and the most objects per byte a reader of the topic can be handed.
import java.nio.charset.StandardCharsets;
import java.util.Properties;
import java.util.Random;
import java.util.SplittableRandom;
import java.util.UUID;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;

public class FastProducer {
    public static void main(String[] a) throws Exception {
        boolean sparse = a.length > 4 && a[4].equals("sparse");
        boolean paced = a.length > 4 && !sparse;
        Properties p = new Properties();
        p.put("bootstrap.servers", a[0]);
        p.put("acks", paced ? "all" : "1");
        p.put("linger.ms", paced ? "5" : sparse ? "0" : "20");
        // A batch.size below one record's size: every record is a batch of its own.
        p.put("batch.size", String.valueOf(paced ? 512 << 10 : sparse ? 1 : 1 << 20));
        // Sparse: every buffered record is a batch object of its own, far larger on the heap than its bytes.
        p.put("buffer.memory", String.valueOf(sparse ? 4 << 20 : 64 << 20));
        if (sparse) p.put("max.in.flight.requests.per.connection", "20");
        p.put("enable.idempotence", paced ? "true" : "false");
        p.put("key.serializer", ByteArraySerializer.class.getName());
        p.put("value.serializer", ByteArraySerializer.class.getName());
        String topic = a[1];
        long n = Long.parseLong(a[2]);
        int parts = Integer.parseInt(a[3]);
        try (KafkaProducer<byte[], byte[]> prod = new KafkaProducer<>(p)) {
            if (!paced && !sparse) {
                byte[] v = new byte[8];
                for (long i = 0; i < n; i++) prod.send(new ProducerRecord<>(topic, (int) (i % parts), null, v));
            } else {
                double rate = paced ? Double.parseDouble(a[4]) : 0;
                Random rng = new Random(1);
                // Ids from a generator seeded per run, values from a StringBuilder: with SecureRandom
                // (UUID.randomUUID) and String.format an unpaced run cost about three times the CPU per record, on
                // the host the producer shares with the worker (docs/bench/pinned-2026-12-02/producer-cpu.txt).
                SplittableRandom ids = new SplittableRandom(System.nanoTime());
                String[] skus = new String[1000];
                byte[][] keys = new byte[skus.length][];
                for (int s = 0; s < skus.length; s++) {
                    skus[s] = String.format("SKU-%06d", s);
                    keys[s] = skus[s].getBytes(StandardCharsets.UTF_8);
                }
                StringBuilder value = new StringBuilder(192);
                long start = System.nanoTime();
                for (long i = 0; i < n; i++) {
                    if (paced) {
                        long due = start + (long) (i * 1e9 / rate);
                        long wait = due - System.nanoTime();
                        if (wait > 1_000_000) Thread.sleep(wait / 1_000_000);
                    }
                    int sku = rng.nextInt(1000);
                    boolean in = rng.nextInt(10) < 6;
                    int qty = (in ? 1 : -1) * (1 + rng.nextInt(100));
                    int warehouse = rng.nextInt(4);
                    // A version-4 UUID: 122 random bits, the version and variant bits set.
                    UUID id = new UUID((ids.nextLong() & ~0xF000L) | 0x4000L,
                                       (ids.nextLong() & 0x3FFFFFFFFFFFFFFFL) | 0x8000000000000000L);
                    value.setLength(0);
                    value.append("{\"movement_id\":\"").append(id).append("\",\"warehouse_id\":\"WH-00")
                         .append(warehouse).append("\",\"sku\":\"").append(skus[sku])
                         .append("\",\"qty\":").append(qty).append(",\"kind\":\"").append(in ? "receipt" : "pick")
                         .append("\",\"occurred_at\":\"2026-11-30T10:00:00+00:00\"}");
                    byte[] bytes = value.toString().getBytes(StandardCharsets.UTF_8);
                    prod.send(new ProducerRecord<>(topic, keys[sku], bytes));
                }
            }
            prod.flush();
        }
    }
}
