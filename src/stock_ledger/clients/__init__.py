"""Every connection the project makes, with the security settings applied here and nowhere else.

- `kafka`: every Kafka client (the group's consumer, readers outside the group, the admin client, the producer),
  each built with the settings' TLS and SASL options; and the one-shot login check that names a bad credential.
- `database`: every PostgreSQL session (the worker's, the owner's and operators', read-only readers', the
  migration's, the small pools), each refusing a URL weaker than STOCK_LEDGER_DATABASE_SSLMODE_MIN, with its
  search_path pinned and (owner and operator sessions) the schema guard run.
- `dberrors`: a database failure as one line with its cause and fix; `tls`: a certificate failure, likewise.
- `servers`: which server a session reached and whether it takes writes; `schemaguard`: nothing planted in
  `public` runs in our sessions.

May import: config, errors. Imported by everything that talks to Kafka or PostgreSQL.
"""
