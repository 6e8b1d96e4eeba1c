"""The `hicache` command line."""
