// What scripts/kafka.sh asks its 3-node cluster, run as a single-file source with the broker's jars:
//   java -cp '<kafka libs>/*' scripts/ClusterAdmin.java BOOTSTRAP controller
//       the node id of the active controller (the KRaft quorum's leader, Admin.describeMetadataQuorum)
//   java -cp '<kafka libs>/*' scripts/ClusterAdmin.java BOOTSTRAP leader TOPIC PARTITION
//       the node id leading the partition (-1: none) and its in-sync replicas, e.g. "2 isr=2,3,1"
// (MetadataQuorumCommand and TopicCommand live in the kafka-tools jar, which the broker's classpath lacks.)
import java.util.List;
import java.util.Properties;
import java.util.stream.Collectors;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.TopicDescription;
import org.apache.kafka.common.Node;
import org.apache.kafka.common.TopicPartitionInfo;

public class ClusterAdmin {
    public static void main(String[] a) throws Exception {
        Properties p = new Properties();
        p.put("bootstrap.servers", a[0]);
        p.put("request.timeout.ms", "10000");
        p.put("default.api.timeout.ms", "30000");
        try (Admin admin = Admin.create(p)) {
            switch (a.length > 1 ? a[1] : "") {
                case "controller" -> System.out.println(admin.describeMetadataQuorum().quorumInfo().get().leaderId());
                case "leader" -> {
                    int partition = Integer.parseInt(a[3]);
                    TopicDescription topic = admin.describeTopics(List.of(a[2])).allTopicNames().get().get(a[2]);
                    TopicPartitionInfo info = topic.partitions().stream().filter(x -> x.partition() == partition)
                        .findFirst().orElseThrow(() -> new IllegalArgumentException(
                            a[2] + " has no partition " + partition));
                    String isr = info.isr().stream().map(n -> String.valueOf(n.id())).collect(Collectors.joining(","));
                    Node leader = info.leader();
                    System.out.println((leader == null || leader.isEmpty() ? -1 : leader.id()) + " isr=" + isr);
                }
                default -> {
                    System.err.println("usage: ClusterAdmin BOOTSTRAP controller | leader TOPIC PARTITION");
                    System.exit(2);
                }
            }
        }
    }
}
