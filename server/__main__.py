"""``python -m server`` is the ``vlguard`` command."""

from server.cli import main

if __name__ == "__main__":
    main()
