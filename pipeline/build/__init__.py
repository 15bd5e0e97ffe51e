"""`pipeline build`: quantize -> compile -> assemble in one command, planned purely and re-run incrementally.

options (BuildOptions, Environment and its detection), settings (the `auto` defaults with their reasons,
and the memory plan; pure), plan (plan_build: the stages and their keys; pure), manifest (build.json,
file hashes, tool versions), run (the executor), progress (the stderr bar), render (plan and summary text).
"""

from pipeline.build.options import BuildOptions, Environment, Weights, detect_environment
from pipeline.build.plan import BuildPlan, Stage, plan_build
from pipeline.build.runner import BuildResult, run_build

__all__ = ["BuildOptions", "BuildPlan", "BuildResult", "Environment", "Stage", "Weights", "detect_environment",
           "plan_build", "run_build"]
