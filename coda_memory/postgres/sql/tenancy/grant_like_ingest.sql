-- A table that a migration adds after `coda-memory grant app` ran: every role that may
-- already insert into ingest_batches (an app role) gets what grant_app.sql grants on
-- {table}, so upgrading needs no new grant. Owners and superusers need none. The roles
-- come from the catalog and are quoted by format('%I').
DO $grant$
DECLARE
    grantee name;
BEGIN
    FOR grantee IN
        SELECT r.rolname
        FROM pg_roles r
        WHERE NOT r.rolsuper
            AND r.rolname <> current_user
            AND has_table_privilege(r.oid, '{schema}.ingest_batches', 'INSERT')
    LOOP
        EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.{table} TO %I', grantee);
    END LOOP;
END
$grant$
