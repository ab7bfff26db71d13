"""No session of ours runs SQL that a less-privileged role planted (issue 32, item 7).

The attack (PostgreSQL 14 and older, and databases upgraded from them, where PUBLIC may CREATE in schema `public`):
the worker role creates `public.||(text, name)`; the owner's next `offsets set` evaluates `'operator:' ||
current_user`, and operator resolution prefers that exact match over pg_catalog's `||(text, anynonarray)`,
whatever the search_path order (the order only decides between identical signatures). So the defence is that no
untrusted role can write to a schema our sessions search:

1. Migration 0009 revokes CREATE on `public` from PUBLIC and refuses to finish while another role can still
   create there, or while `public` holds a function or operator an untrusted role owns.
2. Every session pins `search_path` to SEARCH_PATH: no `"$user"` schema (which someone else may own or write),
   pg_catalog searched first (not named, so implicitly first: PostgreSQL docs, "The Schema Search Path"), so
   built-ins win over any same-signature object in `public`; unqualified CREATE in migrations still lands in
   `public` (with pg_catalog named first, CREATE would target pg_catalog and fail).
3. Owner and operator sessions check (`check`) before their first statement that `public` holds no function or
   operator owned by an untrusted role, and that no other role may create there: a database not yet migrated to
   0009 (an upgraded one, say) is refused with the objects named, instead of running them.

Trusted owners: superusers, the session's own role, the owner of `public` and the database's owner (they can drop
our tables anyway). Extensions' objects belong to the superuser who installed them.

The statements below qualify every operator and function with pg_catalog (`x IN (subquery)` is written
`x OPERATOR(pg_catalog.=) ANY (subquery)`: IN resolves `=` by the search_path): they run before anything is known
about the schema, and before every other statement of the session (clients/database.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from stock_ledger.errors import DatabaseError

if TYPE_CHECKING:
    import asyncpg

SEARCH_PATH: Final = "public"
PIN: Final = f"SET search_path = {SEARCH_PATH}"

_TRUSTED: Final = """
trusted AS (
    SELECT r.oid FROM pg_catalog.pg_roles AS r
     WHERE r.rolsuper OR r.rolname OPERATOR(pg_catalog.=) CURRENT_USER
    UNION SELECT n.nspowner FROM pg_catalog.pg_namespace AS n WHERE n.nspname OPERATOR(pg_catalog.=) 'public'
    UNION SELECT d.datdba FROM pg_catalog.pg_database AS d
     WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
)"""
PLANTED: Final = f"""
WITH {_TRUSTED}, public_schema AS (
    SELECT n.oid FROM pg_catalog.pg_namespace AS n WHERE n.nspname OPERATOR(pg_catalog.=) 'public'
)
SELECT 'function ' AS kind, p.oid::pg_catalog.regprocedure::pg_catalog.text AS name,
       pg_catalog.pg_get_userbyid(p.proowner) AS owner
  FROM pg_catalog.pg_proc AS p
 WHERE p.pronamespace OPERATOR(pg_catalog.=) ANY (SELECT oid FROM public_schema)
   AND NOT p.proowner OPERATOR(pg_catalog.=) ANY (SELECT oid FROM trusted)
UNION ALL
SELECT 'operator ', o.oid::pg_catalog.regoperator::pg_catalog.text, pg_catalog.pg_get_userbyid(o.oprowner)
  FROM pg_catalog.pg_operator AS o
 WHERE o.oprnamespace OPERATOR(pg_catalog.=) ANY (SELECT oid FROM public_schema)
   AND NOT o.oprowner OPERATOR(pg_catalog.=) ANY (SELECT oid FROM trusted)
"""
# Grantee 0 is PUBLIC.
WRITERS: Final = f"""
WITH {_TRUSTED}
SELECT CASE WHEN a.grantee OPERATOR(pg_catalog.=) 0::pg_catalog.oid THEN 'PUBLIC'
            ELSE pg_catalog.pg_get_userbyid(a.grantee)::pg_catalog.text END
  FROM pg_catalog.pg_namespace AS n, pg_catalog.aclexplode(n.nspacl) AS a
 WHERE n.nspname OPERATOR(pg_catalog.=) 'public' AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
   AND NOT a.grantee OPERATOR(pg_catalog.=) ANY (SELECT oid FROM trusted)
"""


async def pin(conn: asyncpg.Connection) -> None:
    """The session's search_path (a SET after connect, as PgBouncer needs: it refuses unknown startup parameters)."""
    await conn.execute(PIN)


async def check(conn: asyncpg.Connection, *, writers: bool = True) -> None:
    """Raise DatabaseError naming what an untrusted role planted in `public` (or who may still create there)."""
    planted = await conn.fetch(PLANTED)
    if planted:
        found = "; ".join(f"{r['kind']}{r['name']} owned by {r['owner']}" for r in planted[:10])
        raise DatabaseError(
            f"refusing to run: schema public holds objects a less-privileged role created, which our SQL could "
            f"call instead of the built-ins ({found}). Look at them, DROP them as the owner, then run "
            "`stock-ledger migrate` (it takes CREATE on public away from PUBLIC)")
    if writers and (roles := [r[0] for r in await conn.fetch(WRITERS)]):
        raise DatabaseError(
            f"refusing to run: {', '.join(roles)} may CREATE in schema public (the PostgreSQL 14 default), so a "
            "less-privileged role could plant an operator our SQL would call: run `stock-ledger migrate` (0009 "
            "revokes it), or as the schema's owner REVOKE CREATE ON SCHEMA public FROM "
            f"{', '.join(roles)}")
