"""sft.py: not built yet (see the open issues)."""


def main():
    raise SystemExit("sft.py is not built yet")


if __name__ == "__main__":
    main()
