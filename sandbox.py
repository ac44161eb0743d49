"""sandbox.py: not built yet (see the open issues). Only the tool schema exists so far."""

TOOL_SCHEMA = {"type": "function", "function": {
    "name": "code_interpreter", "description": "A tool for executing code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to execute."}},
                   "required": ["code"]}}}


def main():
    raise SystemExit("sandbox.py is not built yet")


if __name__ == "__main__":
    main()
