"""What setup.sh leaves for the commands after it, tested on its own functions (the
whole script is the README's first command, run by CI on a fresh clone)."""

import re
import subprocess

from conftest import REPO


def shell_function(name: str) -> str:
    text = (REPO / "setup.sh").read_text()
    found = re.search(rf"^{name}\(\) {{\n.*?^}}\n", text, re.S | re.M)
    assert found, f"setup.sh has no function {name}"
    return found.group(0)


def test_the_data_dir_given_to_set_up_is_kept_in_the_activate_script(tmp_path):
    """Issue 53 item 8: `MPITRAIN_DATA_DIR=../shared/data/mnist bash setup.sh` reached
    only set-up's own run; later commands fell back to the digits."""
    venv, data = tmp_path / "venv", tmp_path / "my data"
    (venv / "bin").mkdir(parents=True)
    data.mkdir()
    (venv / "bin" / "activate").write_text("export MPITRAIN_DATA_DIR=/old\nexport X=1\n")
    script = shell_function("keep_data_dir") + f'keep_data_dir "{venv}"\n' \
        '. "$VENV/bin/activate"; printf %s "$MPITRAIN_DATA_DIR"'
    for given in (str(data), "my data"):  # absolute, and relative to set-up's directory
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True,
                              text=True, env={"MPITRAIN_DATA_DIR": given, "VENV": str(venv),
                                              "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        assert done.stdout == str(data)
    lines = (venv / "bin" / "activate").read_text().splitlines()
    assert lines[0] == "export X=1" and len(lines) == 2  # the earlier one replaced
