-- A table that a migration adds after `coda-memory grant app` ran: every role that was
-- granted INSERT on {source} itself (an app role: ingest_batches for the tables added
-- after it, observations for ingest_batches and redis_imports) gets what grant_app.sql
-- grants on {table} ({privileges}), so upgrading needs no new grant. Only grants written in the table's ACL count: a role
-- that holds the privilege through membership (a member of the app role, or of
-- pg_write_all_data, which may write every table but read none) gets nothing of its
-- own, and predefined roles (pg_*), PUBLIC, owners and superusers are left out. The
-- roles come from the catalog and are quoted by format('%I').
DO $grant$
DECLARE
    grantee name;
BEGIN
    FOR grantee IN
        SELECT DISTINCT r.rolname
        FROM pg_class c
        CROSS JOIN LATERAL aclexplode(c.relacl) AS acl
        JOIN pg_roles r ON r.oid = acl.grantee
        WHERE c.oid = '{schema}.{source}'::regclass
            AND acl.privilege_type = 'INSERT'
            AND acl.grantee <> c.relowner
            AND NOT r.rolsuper
            AND r.rolname <> current_user
            AND r.rolname NOT LIKE 'pg\_%'
    LOOP
        EXECUTE format('GRANT {privileges} ON {schema}.{table} TO %I', grantee);
    END LOOP;
END
$grant$
