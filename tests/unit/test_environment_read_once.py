"""Settings are read from the environment in one place (streams/config.py)."""

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "streams"
# Reading a variable: os.environ[...] / .get(...), os.getenv(...). Copying the whole environment
# for a child process ({**os.environ, ...}) is not reading a setting.
READ = re.compile(r"os\.environ(\[|\.get\()|os\.getenv\(")


def test_no_module_but_config_reads_an_environment_variable():
    """Given every module of the package,
    When their source is searched for reads of single environment variables,
    Then only streams/config.py reads any (everything else gets its settings from Config)."""
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "config.py" and READ.search(p.read_text()))
    assert readers == []
