"""GSM8K with lm-eval-harness's protocol: what experiments/eval_gsm8k.py and experiments/sweep.py share.

A run: the checkpoint found and its length checked (`loading`), the settings with the model's defaults
(`settings`), the data planned and checked (`data`), all before the output directory is claimed (`outdir`);
then the model loaded, the lm-eval task written, and each strategy through one resumable lm-eval pass
(`run`), its rows joined with our NFE and timing stats. Every mistake a user can fix is a `UserError`,
which the command lines print in one line (`command_line`); its messages name their shared flags.

  settings      EvalSettings (canvas, rules' shared settings, prompts, batching, devices), DEFAULTS
  loading       find_checkpoint, check_gen_length, load_model
  data          read_gsm8k_jsonl, DataPlan, plan_data, local_task, Task, write_task
  outdir        check_output, default_output, OutputDir (OUT/.lock), held_output, holding, write_atomically
  progress      RunningAccuracy (the progress bar's), Progress (what a run that ends now keeps)
  run           resume_key, evaluate_once, run_strategy, collect, summarize, rule_record, config_record
  command_line  load_user_rules (--rules), exit_status (how a run ends: localleap_jax.cli.run_command with
                what it kept); the flags' types and the parser are localleap_jax.cli's
"""

from localleap_jax.gsm8k.command_line import RULES_HELP, exit_status, load_user_rules
from localleap_jax.gsm8k.data import DataPlan, Task, local_task, plan_data, read_gsm8k_jsonl, write_task
from localleap_jax.errors import UserError
from localleap_jax.gsm8k.loading import check_gen_length, find_checkpoint, load_model, read_model_config
from localleap_jax.gsm8k.outdir import (OutputDir, check_output, default_output, held_output, holding,
                                        write_atomically)
from localleap_jax.gsm8k.progress import Progress, RunningAccuracy
from localleap_jax.gsm8k.run import (collect, config_record, evaluate_once, forget_answers, resume_key, rule_record,
                                     run_strategy, summarize, task_manager)
from localleap_jax.gsm8k.settings import DEFAULTS, EvalSettings, default_strategies, model_defaults

__all__ = ["DEFAULTS", "DataPlan", "EvalSettings", "OutputDir",
           "Progress", "RULES_HELP", "RunningAccuracy", "Task", "UserError", "check_gen_length", "check_output", "collect", "default_output",
           "config_record", "evaluate_once", "exit_status", "find_checkpoint", "forget_answers", "held_output", "holding",
           "default_strategies", "load_model", "load_user_rules", "local_task", "read_model_config", "model_defaults", "plan_data", "read_gsm8k_jsonl",
           "resume_key", "rule_record", "run_strategy", "summarize", "task_manager", "write_atomically",
           "write_task"]
