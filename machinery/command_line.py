"""A training command from start to end: parse the config (or a resume state), start the
process, train; or --plan. However it ends, it ends one way: an error the user can mend, a full
disk, a signal or a peer that exited is one line on stderr and in the run's log, with an exit
code, never a traceback; the log is closed and the process group destroyed.
"""
import sys

import torch.distributed as dist

from machinery import memory_budget, resume
from machinery.config import ConfigError
from machinery.cpu_runtime import bf16_gemms
from machinery.errors import UserError
from machinery.processes import (DISK_FULL_ERRNOS, EXIT_USER_ERROR, SIGNAL_EXIT_CODES, Interrupted, hold_signals,
                                 interruption_line, launch_environment, peer_exited, report_error, restore_signals,
                                 shows_interruptions, start_process, stop_on_signals)
from machinery.run_report import stop, where_the_run_is
from records.logfile import ERROR_PREFIX, LogWriteError, RunLog, write_failure


def run_command(recipe, argv=None, command=None, run=None):
    """Train `recipe` (train_gpt) from the command line `argv` (default sys.argv[1:]), or --plan;
    `run(argv)` instead runs another entry point's `command` (evaluation/evaluate.py's eval and
    sample) under the same ending. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    log, launch, handlers = None, None, None
    try:
        launch = launch_environment()
        handlers = stop_on_signals()
        if run is not None:
            return run(argv)
        if "--plan" in argv:
            return memory_budget.plan_command(recipe, argv)
        if any(a.startswith(("--eval", "--sample")) for a in argv):
            raise ConfigError("a checkpoint is evaluated or sampled by evaluation/evaluate.py: "
                              "python evaluation/evaluate.py --eval=PATH or --sample=PATH")
        resume_from, argv = resume.resume_argument(argv)
        h, resumed = (resume.resumed_config(resume_from, argv) if resume_from
                      else (recipe.parse_config(memory_budget.with_machine_preset(recipe, argv, launch)), None))
        pg = start_process(h)
        log = RunLog(h.log_dir, pg.master)
        with bf16_gemms(recipe.gemm_path(h, pg.device)):
            recipe.train(h, pg, log, resumed)
        return 0
    except Interrupted as e:
        return stop(log, interruption_line(launch, e.signal_name, where_the_run_is(log, command)),
                    SIGNAL_EXIT_CODES[e.signal_name], shows_interruptions(launch))
    except UserError as e:        # every module's error that the user can mend (machinery/errors.py)
        hold_signals()
        return stop(log, f"{ERROR_PREFIX}{e}", EXIT_USER_ERROR, report_error(launch, f"{ERROR_PREFIX}{e}"))
    except LogWriteError as e:
        hold_signals()
        return stop(None, f"{ERROR_PREFIX}{e}", EXIT_USER_ERROR, report_error(launch, f"{ERROR_PREFIX}{e}"))
    except OSError as e:
        hold_signals()
        path = e.filename or "a file"
        line = ERROR_PREFIX + (write_failure(path, e) if e.errno in DISK_FULL_ERRNOS else f"{path}: {e.strerror}")
        return stop(log, line, EXIT_USER_ERROR, report_error(launch, line))
    except RuntimeError as e:
        hold_signals()
        if not peer_exited(launch, e):
            raise
        return stop(log, interruption_line(launch, None, where_the_run_is(log, command)), EXIT_USER_ERROR,
                    shows_interruptions(launch))
    finally:
        if log is not None:
            log.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        restore_signals(handlers)

