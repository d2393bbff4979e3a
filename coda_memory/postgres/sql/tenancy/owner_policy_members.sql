-- The owner's policy asks a member of the owner for the setting too (migration 0020).
-- The policy applies to every role with the owner's privileges, its members included,
-- and 0004's expression let any role but the owner itself through without the setting
-- (current_user <> owner, meant for the owner's views read by another role): a member
-- saw and could write every identity's rows on a connection that set nothing. A role
-- without the owner's privileges still reads every row through the owner's views (the
-- aggregate views granted to analysts). pg_has_role is asked once per statement.
-- The owner is the role the policy names; {owner_allowed} is the expression for it.
DO $tenancy$
DECLARE
    policy record;
    allowed text;
BEGIN
    FOR policy IN
        SELECT p.polrelid::regclass AS tab, r.rolname AS owner
        FROM pg_catalog.pg_policy p
        JOIN pg_catalog.pg_class c ON c.oid = p.polrelid
        JOIN pg_catalog.pg_roles r ON r.oid = p.polroles[1]
        WHERE c.relnamespace = '{schema}'::regnamespace
            AND p.polname = 'all_identities'
    LOOP
        allowed := format({owner_allowed}, 'coda_memory.all_identities', 'on', policy.owner);
        EXECUTE format(
            'ALTER POLICY all_identities ON %s USING (%s) WITH CHECK (%s)',
            policy.tab, allowed, allowed
        );
    END LOOP;
END
$tenancy$
