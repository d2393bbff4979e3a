-- The checkpoint of an identity seen for the first time (or whose row forget deleted).
INSERT INTO {schema}.checkpoints (identity_id)
VALUES (:identity_id)
ON CONFLICT (identity_id) DO NOTHING
