"""Alembic history of the state store (``script_location = "haru_db:migrations"``).

One history serves both engines; run it with :func:`haru_db.upgrade`, never ``create_all``.
"""
