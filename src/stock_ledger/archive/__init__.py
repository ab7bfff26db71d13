"""Retention and archival: old segments of stock_movements to Parquet files with a manifest, checked before they
leave the database (run.py), and the archives listed, verified and restored for an audit (check.py)."""
