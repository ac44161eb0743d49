"""rl.py: not built yet (see the open issues)."""


def main():
    raise SystemExit("rl.py is not built yet")


if __name__ == "__main__":
    main()
