"""Alembic migrations of the daemon's store (run by `Store` when it opens)."""
