"""The logic of the project's command lines, one module per command; experiments/<name>.py is only its entry:

  eval_gsm8k        python experiments/eval_gsm8k.py         GSM8K through lm-eval, strategies side by side
  sweep             python experiments/sweep.py              the rules over grids of their settings: Figure 4, Pareto
  analyze_dynamics  python experiments/analyze_dynamics.py   traces and the paper's Figures 1 and 2
  eval_likelihood   python experiments/eval_likelihood.py    multiple-choice tasks by log-likelihood
  train_tiny        python experiments/train_tiny.py         the embedded small models' training
  plots             (analyze_dynamics', sweep's figures)

Each `main(argv=None) -> int` reads its flags and ends through `localleap_jax.cli` (one `error: ...` line and
exit 2 for a mistake, 130 for Ctrl-C / SIGTERM / SIGHUP). The top layer of the library: nothing in it imports
these modules.
"""
