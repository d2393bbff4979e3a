-- The k-anonymity floor that binds the role reading the analytics views (current_user:
-- a view checks its tables with its owner's privileges but runs as the reader). A role
-- that may read the facts table (the owner, which asks for every identity, or an app
-- role, which sets any identity it serves) reads single users' rows anyway: 0 binds it,
-- so the views hide nothing from it and the analytics functions' min_users alone
-- applies (a tool known only from facts, with 0 users in the window, stays a row of
-- tool_effectiveness for it, as before the floor). Any other role (an analyst)
-- is bound by analytics_floor.min_users, which only the owner may change; a session
-- setting would not do, since any role may set its own. Without the row (deleted), the
-- floor is NULL and every view is empty: it fails closed.
CREATE VIEW {schema}.analytics_reader_floor AS
SELECT
    CASE
        WHEN has_table_privilege('{schema}.facts', 'SELECT') THEN 0
        ELSE (SELECT analytics_floor.min_users FROM {schema}.analytics_floor)
    END AS min_users;

COMMENT ON VIEW {schema}.analytics_reader_floor IS
    'The k-anonymity floor for the role reading the analytics views: 0 for a role that may '
    'read the facts table, analytics_floor.min_users (default 5) for any other (an analyst). '
    'The owner changes it with UPDATE analytics_floor SET min_users = <n>.';
