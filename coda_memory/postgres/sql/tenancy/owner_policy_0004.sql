-- The owner's policy as migrations 0004 and 0006 created it, and as 0020's downgrade
-- leaves it (owner_policy.sql is the current one): any role but the owner itself is let
-- through without coda_memory.all_identities = 'on', a member of the owner included.
-- Work across identities, for the role that migrates (the owner) only:
-- * maintenance run as the owner (consolidate --all, prune, stats, analytics), which
--   asks for it with coda_memory.all_identities = 'on';
-- * the owner's views read by another role (current_user is then that role, while the
--   policy applies as the view's owner): the aggregate views granted to analysts, which
--   return no identity_id. No per-identity view is granted to anyone.
-- The owner's name is fixed here, when the policy is created (format's %L quotes it).
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
