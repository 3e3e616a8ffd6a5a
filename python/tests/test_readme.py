"""The README's "From Python" example runs and trains."""
import pathlib
import re


def test_readme_example_trains(capsys):
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## From Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md (From Python)", "exec"), scope)
    assert scope["loss"].item() < 0.1, scope["loss"].item()
    assert "loss" in capsys.readouterr().out
