"""The prompt texts DemyAgent-4B and Qwen3-4B-RA-SFT were trained and evaluated with.

Every string is upstream's, character for character (typos such as "sumbit" and the stray quote
after "# YOUR CODE HERE" included): the checkpoints saw them. Source: Gen-Verse/Open-AgentRL
recipe/demystify/reward.py (constants and CustomRLHFDataset's map functions, named in each comment)
read at Tianshi-Xu/Open-AgentRL 627a2844, as in Blackteaxx/DemyAgent, wencanning/test-opd and
jianghoucheng/Agent_On_Policy_Distillation (Tianshi-Xu's 1f781221 differs in MATH_1, MATH_2 and
AGENT: its own experiment). CODE_INTERPRETER: sandbox_fusion_tool_config.yaml's schema in the key
order verl dumps, as the models saw it. rollout.py renders the text as the user turn.
"""

ANSWER_FORMAT = ("\nRemember once you make sure the current answer is your final answer, do not call the tools again "
                 "and directly output the final answer in the following text format, the answer format must be: "
                 "\\boxed{'The final answer goes here.'}.")  # answer_format
MATH_1 = "Analyze and solve the following math problem step by step. \n\n"  # math_prompt_1
MATH_2 = ("\n\nThe tool could be used for more precise and efficient calculation and could help you to verify "
          "your result before you reach the final answer.")  # math_prompt_2
AGENT = ("\n\n**Note: You should first analyze the problem and form a high-level solution strategy, then utilize "
         "the tools to help you solve the problem.**")  # agent_prompt

GPQA_START = "Analyze and solve the following {domain} problem step by step. \n\n"  # map_fn_gpqa prompt_1
GPQA_LETTER = "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"  # map_fn_gpqa
LCB_START = ("You will be given a question (problem specification) and will generate a correct Python program that "
             "matches the specification and passes all tests.\n\n")  # map_lcb start_prompt
LCB_CODE = ("\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not directly test "
            "on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
            "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n```python\n"
            "# YOUR CODE HERE\n\"")  # map_lcb code_prompt
LCB_EXAMPLES = "\nHere are some input and output examples of the expected code:\nInput:"  # map_lcb public_examples
SUBMIT_CODE = ("\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once you "
               "make sure the current code is correct, do not call the tools again and submit your code within "
               "```python\n# YOUR CODE HERE\n```.")  # map_lcb, map_fn_skywork
UNITS_DAPO = ("\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the "
              "numerical value of the final answer only, without any units.")  # map_fn2
UNITS_SKYWORK = ("\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be the "
                 "final numerical value of the final answer only, without any units.")  # map_fn_skywork, math rows

CODE_INTERPRETER = {"type": "function", "function": {
    "name": "code_interpreter", "description": "A tool for executing code.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to execute."}},
                   "required": ["code"]}}}


def aime(problem):
    """map_fn (AIME 2024 / 2025)."""
    return MATH_1 + problem + MATH_2 + AGENT + ANSWER_FORMAT


def gpqa(problem, domain):
    """map_fn_gpqa; the options are written into `problem` as "(A) ...\\n(B) ..."."""
    return GPQA_START.format(domain=domain) + problem + MATH_2 + AGENT + ANSWER_FORMAT + GPQA_LETTER


def lcb(problem, inputs, outputs):
    """map_lcb; the examples are Python's str() of the two lists, as upstream prints them."""
    examples = LCB_EXAMPLES + str(inputs) + "\nOutput:\n" + str(outputs)
    return LCB_START + problem + examples + AGENT + LCB_CODE + SUBMIT_CODE


def rl(content, data_source):
    """An Open-AgentRL-30K user turn: map_fn2 for math_dapo / mega-science, else map_fn_skywork."""
    if data_source in ("math_dapo", "mega-science"):
        return content + UNITS_DAPO
    if "code" in data_source:
        return content + AGENT + SUBMIT_CODE
    return MATH_1 + content + MATH_2 + AGENT + ANSWER_FORMAT + UNITS_SKYWORK
