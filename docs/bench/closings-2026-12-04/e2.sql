SELECT brin_desummarize_range('stock_movements_p22_o0_occurred_at_kafka_offset_idx', 9344);
SELECT brin_summarize_range('stock_movements_p22_o0_occurred_at_kafka_offset_idx', 9344);
SET enable_seqscan = off; SET max_parallel_workers_per_gather = 0;
EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) SELECT count(*) FROM stock_movements_p22_o0 WHERE occurred_at <= '2026-12-03 19:27:06.718203+00' AND kafka_offset >= 1166666 AND ((occurred_at - COALESCE(kafka_timestamp, applied_at)) >= '-00:15:00'::interval) AND ((occurred_at - COALESCE(kafka_timestamp, applied_at)) <= '00:05:00'::interval);
