"""Alembic revision scripts (loaded by Alembic from this folder, never imported by haru_db)."""
