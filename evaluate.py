"""evaluate.py: not built yet (see the open issues)."""


def main():
    raise SystemExit("evaluate.py is not built yet")


if __name__ == "__main__":
    main()
