"""terminal-bench: Harbor-format shell tasks scored by their own test.sh (torch-free).

Entry point (group ``miles_agent.envs``): ``terminal-bench = "miles_agent.envs.terminal_bench:TerminalBenchEnv"``.
"""

from .env import BASH_TOOL, SHIPPED_TASKS, TerminalBenchEnv, TerminalBenchSession
from .harbor import HarborTask, TaskFormatError, TaskSymlinkError, load_task, load_tasks, staged_files

__all__ = ["BASH_TOOL", "SHIPPED_TASKS", "HarborTask", "TaskFormatError", "TaskSymlinkError", "TerminalBenchEnv",
           "TerminalBenchSession", "load_task", "load_tasks", "staged_files"]
