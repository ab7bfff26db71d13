-- Issue 32: no role below the owner may create objects in a schema the ledger's sessions search. On PostgreSQL 14
-- and older (and databases upgraded from them) PUBLIC may CREATE in schema public: the worker role could create an
-- operator such as public.||(text, name), which an owner's statement then calls instead of the built-in (an exact
-- argument match wins over pg_catalog's whatever the search_path order) with the owner's privileges.
-- The sessions pin search_path to public (pg_catalog implicitly first) and check at start (schemaguard.py).
--
-- REVOKE by a role that does not own the schema only warns; so check the outcome and refuse to finish, naming the
-- fix, rather than leave the schema writable. Likewise for a function or operator a less-privileged role already
-- planted in public: a human must look at it before anything runs as the owner again.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
REVOKE CREATE ON SCHEMA public FROM stock_ledger_app, stock_ledger_reader;

DO $$
DECLARE
    writers text;
    planted text;
BEGIN
    WITH trusted AS (
        SELECT r.oid FROM pg_catalog.pg_roles AS r
         WHERE r.rolsuper OR r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
        UNION SELECT n.nspowner FROM pg_catalog.pg_namespace AS n WHERE n.nspname OPERATOR(pg_catalog.=) 'public'
        UNION SELECT d.datdba FROM pg_catalog.pg_database AS d
         WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
    )
    SELECT pg_catalog.string_agg(CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0::pg_catalog.oid THEN 'PUBLIC'
                                      ELSE pg_catalog.pg_get_userbyid(a.grantee)::pg_catalog.text END, ', ')
      INTO writers
      FROM pg_catalog.pg_namespace AS n, pg_catalog.aclexplode(n.nspacl) AS a
     WHERE n.nspname OPERATOR(pg_catalog.=) 'public' AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
       AND a.grantee NOT IN (SELECT oid FROM trusted);
    IF writers IS NOT NULL THEN
        RAISE EXCEPTION 'schema public is still writable by %: as its owner (%), run REVOKE CREATE ON SCHEMA public FROM %; then stock-ledger migrate again',
            writers, (SELECT pg_catalog.pg_get_userbyid(nspowner) FROM pg_catalog.pg_namespace
                       WHERE nspname OPERATOR(pg_catalog.=) 'public'), writers;
    END IF;

    WITH trusted AS (
        SELECT r.oid FROM pg_catalog.pg_roles AS r
         WHERE r.rolsuper OR r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
        UNION SELECT n.nspowner FROM pg_catalog.pg_namespace AS n WHERE n.nspname OPERATOR(pg_catalog.=) 'public'
        UNION SELECT d.datdba FROM pg_catalog.pg_database AS d
         WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
    ), public_schema AS (
        SELECT n.oid FROM pg_catalog.pg_namespace AS n WHERE n.nspname OPERATOR(pg_catalog.=) 'public'
    )
    SELECT pg_catalog.string_agg(o, '; ') INTO planted FROM (
        SELECT pg_catalog.format('function %s owned by %s', p.oid::pg_catalog.regprocedure,
                                 pg_catalog.pg_get_userbyid(p.proowner)) AS o
          FROM pg_catalog.pg_proc AS p
         WHERE p.pronamespace IN (SELECT oid FROM public_schema) AND p.proowner NOT IN (SELECT oid FROM trusted)
        UNION ALL
        SELECT pg_catalog.format('operator %s owned by %s', x.oid::pg_catalog.regoperator,
                                 pg_catalog.pg_get_userbyid(x.oprowner))
          FROM pg_catalog.pg_operator AS x
         WHERE x.oprnamespace IN (SELECT oid FROM public_schema) AND x.oprowner NOT IN (SELECT oid FROM trusted)
    ) AS found;
    IF planted IS NOT NULL THEN
        RAISE EXCEPTION 'schema public holds objects a less-privileged role created (%): look at them, DROP them as the owner, then run stock-ledger migrate again',
            planted;
    END IF;
END
$$;
