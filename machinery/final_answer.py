"""machinery/final_answer.py: a response's final answer, and the normalisation both sides of the
math and choice graders go through (evaluate.py's docstring: where they depart from the paper's)."""

import re

BOX_WINDOW = 100  # the paper's strict grader looks only at the last 100 characters


def final_answer_text(response):
    """The text after the last tool reply (the model's final turn), end-of-turn tokens stripped."""
    response = response if isinstance(response, str) else "" if response is None else str(response)
    cut = response.rfind("</tool_response>")
    text = (response[cut + len("</tool_response>"):] if cut >= 0 else response).rstrip()
    end = len(text)                    # back over the end tokens in one pass, copying none
    while text.endswith(("<|im_end|>", "<|endoftext|>"), 0, end):
        end = text.rfind("<", 0, end)
        while end and text[end - 1].isspace():
            end -= 1
    return text[:end]


def boxed_answer(response):
    """The content of the last \\boxed{...} / \\fbox{...} in the final answer's last BOX_WINDOW
    characters, braces balanced; None when there is none or it never closes."""
    text = final_answer_text(response)[-BOX_WINDOW:]
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i, depth = text.index("{", start), 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


UNIT_WORDS = set((
    "degrees degree cm centimeters centimetres mm meters metres meter metre km kilometers inches "
    "inch feet foot ft miles mile mph hours hour hrs minutes minute mins seconds second sec "
    "dollars dollar cents cent units unit square sq ways points students people days day years "
    "year pounds lbs grams gram kg liters litres ml").split())
TEXT_ONLY_UNITS = {"m", "s", "g", "h", "l", "min", "cm^2"}  # only inside \text{}: else a variable
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textrm|textit|mathrm|mathbf|mbox|operatorname)"
                       r"\s*\{([^{}]*)\}")
_TEXT_UNIT = re.compile(_TEXT_CMD.pattern + r"(?:\^\{?[23]\}?)?")  # \text{cm}^2
_TRAILING_UNIT = re.compile(r"(?:\s|\\ |~)*(?<![A-Za-z\\])(?:" + "|".join(sorted(UNIT_WORDS)) +
                            r")\b(?:\^\{?[23]\}?)?\s*$")


def _is_unit(words):
    words = words.strip().strip(".").lower()
    return not words or all(w in UNIT_WORDS or w in TEXT_ONLY_UNITS
                            for w in re.split(r"[\s~]+", words))


def normalize_math(answer):
    """A canonical string for exact matching (Minerva-style, bounded input)."""
    s = str(answer)[:2000].strip().split("=")[-1]                 # "x = 5" -> " 5"
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for t in ("^{\\circ}", "^\\circ", "\\circ", "\\%", "%", "\\$", "$", "\\!"):
        s = s.replace(t, "")
    rest = _TEXT_UNIT.sub(lambda m: "" if _is_unit(m.group(1)) else m.group(0), s).strip()
    s = rest if rest and rest != s.strip() else s                 # a unit after a value goes
    s = _TRAILING_UNIT.sub("", _TEXT_CMD.sub(lambda m: m.group(1), s))   # other text is unwrapped
    for t in ("\\,", "\\;", "\\:", "\\ ", "~"):
        s = s.replace(t, "")
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace("{,}", "")
    s = re.sub(r"\\frac([0-9a-zA-Z])([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)   # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\sqrt([0-9a-zA-Z])", r"\\sqrt{\1}", s).rstrip(".")
    return str(int(s)) if re.fullmatch(r"[+-]?\d+", s) else s     # "033" -> "33", "+5" -> "5"


def normalize_choice(answer):
    s = _TEXT_CMD.sub(lambda m: m.group(1), str(answer)[:200])
    return re.sub(r"[\s$]", "", s).strip("()[]{}.:*")
