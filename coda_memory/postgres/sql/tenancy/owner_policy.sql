-- Work across identities, for the role that migrates (the owner) only:
-- * maintenance run as the owner (consolidate --all, prune, stats, analytics), which
--   asks for it with coda_memory.all_identities = 'on';
-- * the owner's views read by another role (current_user is then that role, while the
--   policy applies as the view's owner): the aggregate views granted to analysts, which
--   return no identity_id. No per-identity view is granted to anyone.
-- A role with the owner's privileges (the owner, and a member that inherits them) asks
-- for the setting too; only a role without them passes without it: the expression that
-- migration 0020 gave the existing tables (owner_policy_members.sql). The owner's name is
-- fixed here, when the policy is created (format's %L quotes it). Migrations 0004 and
-- 0006 created 0004's expression (owner_policy_0004.sql).
DO $tenancy$
DECLARE
    allowed text := format(
        '(SELECT current_setting(%L, true)) = %L OR (SELECT NOT pg_has_role(%L, %L))',
        'coda_memory.all_identities', 'on', current_user, 'USAGE'
    );
BEGIN
    EXECUTE format(
        'CREATE POLICY all_identities ON {schema}.{table} TO CURRENT_USER '
        'USING (%s) WITH CHECK (%s)',
        allowed, allowed
    );
END
$tenancy$
