"""``python -m haru_server``: the ``haru`` command line."""

from haru_server.cli import main

if __name__ == "__main__":
    main()
