"""The README's code runs as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_every_python_block_of_the_readme_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2
    for number, block in enumerate(blocks):
        done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, f"README block {number} failed:\n{block}\n{done.stderr}"
