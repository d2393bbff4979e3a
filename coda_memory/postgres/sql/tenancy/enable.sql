-- Row-level security on one per-identity table: every role but a superuser (or one with
-- BYPASSRLS), the table's owner included (FORCE), reaches only the rows a policy allows.
ALTER TABLE {schema}.{table}
    ENABLE ROW LEVEL SECURITY,
    FORCE ROW LEVEL SECURITY
