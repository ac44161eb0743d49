"""Prompt templates: how a problem is put to the model.

The wording is the project's own; the instructions are the paper's (Open-AgentRL's
reward.py prompts): analyse step by step before computing, use the code tool for exact
computation and checking, stop calling the tool once sure, and give the final answer in a
fixed place the grader looks at:
  math            -> \\boxed{value}, no units inside the box
  multiple choice -> \\boxed{LETTER}, the uppercase letter of the option
  code            -> one ```python block with the complete program

The prompt is the whole user message; rollout.py renders it with the chat template and the
code_interpreter tool schema, and adds no system prompt.

Two kinds of callers:
  - raw problems (AIME, GPQA, LiveCodeBench) go through math_prompt / choice_prompt /
    code_prompt, which wrap the bare problem text;
  - the RL rows of Open-AgentRL-30K already carry a task instruction in their user message,
    so prepare.py keeps that message and appends UNITS_SUFFIX (math) or CODE_SUFFIX (code),
    as the paper's repository does, instead of wrapping it a second time.
"""

TOOL_NOTE = (
    "You can run Python with the code interpreter tool. Use it when it helps: for exact "
    "arithmetic, for calculations too long to do by hand, and to check intermediate steps "
    "or your final result. Do not call it for things you can simply reason out."
)

FINAL_BOX = (
    "When you are sure of the final answer, stop calling the tool and write the answer "
    "as \\boxed{...}."
)

NO_UNITS = (
    "Put only the final value inside \\boxed{}: no units and no explanation."
)

MATH_SUFFIX = "\n\n" + TOOL_NOTE + "\n" + FINAL_BOX + " " + NO_UNITS

# For RL rows whose message already asks for tool use and a boxed answer (the math_dapo
# and mega-science rows of Open-AgentRL-30K): only the reminder about units is added.
UNITS_SUFFIX = "\n" + NO_UNITS

CODE_FINAL = (
    "Before you submit, you may use the code tool to run your code on small tests you "
    "write yourself. When you are confident that it is correct, stop calling the tool and "
    "give your complete solution in one block:\n```python\n# your code\n```"
)

CODE_SUFFIX = "\n\n" + TOOL_NOTE + "\n" + CODE_FINAL


def math_prompt(problem):
    return (
        "Solve the following math problem. Work through it step by step and explain your "
        "reasoning before you calculate anything.\n\n"
        + problem.strip()
        + MATH_SUFFIX
    )


def format_choices(choices):
    """['x', 'y'] -> '(A) x\\n(B) y'"""
    return "\n".join(f"({chr(ord('A') + i)}) {str(c).strip()}" for i, c in enumerate(choices))


def choice_prompt(problem, choices=None, domain=None):
    """A multiple-choice question; `choices` is None when the options are already written
    into the problem text (as in Open-AgentRL-Eval's GPQA file)."""
    subject = f"{domain} " if domain else ""
    body = problem.strip()
    if choices:
        body += "\n\n" + format_choices(choices)
    return (
        f"Answer the following {subject}multiple-choice question. Work through it step by "
        "step and explain your reasoning before you calculate anything.\n\n"
        + body
        + "\n\n" + TOOL_NOTE + "\n" + FINAL_BOX
        + " Inside the box put only the uppercase letter of the correct option, for "
        "example \\boxed{A}."
    )


def code_prompt(problem, starter_code=None):
    """A programming problem. With starter code (LiveCodeBench 'functional' problems) the
    model completes the given class or function; without, it writes a stdin/stdout program."""
    text = (
        "Write a Python program that solves the problem below and passes all of its "
        "tests.\n\n" + problem.strip() + "\n\n"
    )
    if starter_code and starter_code.strip():
        text += (
            "Complete this starter code; keep the class and method names and the "
            "signature:\n```python\n" + starter_code.strip() + "\n```\n"
        )
    else:
        text += (
            "Your program reads the input from standard input and writes the answer to "
            "standard output. Do not hard-code the sample inputs.\n"
        )
    return text + "\n" + TOOL_NOTE + "\n" + CODE_FINAL


def prompt_for(kind, problem, **kw):
    """Dispatch on the project's problem kinds."""
    if kind == "math":
        return math_prompt(problem)
    if kind == "choice":
        return choice_prompt(problem, kw.get("choices"), kw.get("domain"))
    if kind == "code":
        return code_prompt(problem, kw.get("starter_code"))
    raise ValueError(f"unknown problem kind {kind!r} (expected math, choice or code)")
