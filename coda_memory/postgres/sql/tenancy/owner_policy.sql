-- Work across identities, for the role that migrates (the owner) only:
-- * maintenance run as the owner (consolidate --all, prune, stats, analytics), which
--   asks for it with coda_memory.all_identities = 'on';
-- * the owner's views read by another role (current_user is then that role, while the
--   policy applies as the view's owner): the aggregate views granted to analysts, which
--   return no identity_id. No per-identity view is granted to anyone.
-- The owner's name is fixed here, when the policy is created (format's %L quotes it).
-- Migration 0020 asks the owner's members for the setting too (owner_policy_members.sql).
DO $tenancy$
DECLARE
    allowed text := format(
        '(SELECT current_setting(%L, true)) = %L OR current_user <> %L',
        'coda_memory.all_identities', 'on', current_user
    );
BEGIN
    EXECUTE format(
        'CREATE POLICY all_identities ON {schema}.{table} TO CURRENT_USER '
        'USING (%s) WITH CHECK (%s)',
        allowed, allowed
    );
END
$tenancy$
