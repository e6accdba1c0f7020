"""Repository-wide pytest set-up.

haru-db's pytest plugin (fresh migrated SQLite and PostgreSQL databases per test) is opt-in:
pytest only honours ``pytest_plugins`` in the root conftest, so it is requested here for
every member's tests.
"""

pytest_plugins = ["haru_db.testing"]
