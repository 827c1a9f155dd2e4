"""The local content-addressed store: blobs by digest, tags, assembled-image cache."""
