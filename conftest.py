"""Repository-wide pytest set-up.

haru-db's pytest plugin (fresh migrated SQLite and PostgreSQL databases per test) is opt-in:
pytest only honours ``pytest_plugins`` in the root conftest, so it is requested here for
every member's tests. A lane that installs only some members (the SkyPilot lane installs the
drivers alone) runs without it.
"""

import importlib.util

pytest_plugins = ["haru_db.testing"] if importlib.util.find_spec("haru_db") is not None else []
