from ddpify.check.rule import Invalid, Rule


class SyntaxErrorRule(Rule):
    """File cannot be parsed.

    ## What it does
    Reports a file that is not valid Python (the runner emits it; the other files are still checked).

    ## Why is this bad?
    Nothing in the file can be checked, and the script will not run under torchrun either.

    ## Example
    ```python
    def main(:
        ...
    ```

    ## Use instead
    ```python
    def main():
        ...
    ```

    ## Fix safety
    No automatic fix.

    ## References
    - https://docs.python.org/3/reference/grammar.html
    """

    CODE = "DDP000"
    NAME = "syntax-error"
    MESSAGE = "cannot parse file; fix the syntax error so the file can be checked"
    DISTRIBUTED_ONLY = False
    VALID = ["x = 1\n"]
    INVALID = [Invalid("def main(:\n    pass\n")]

    def check(self, ctx):
        return ()
