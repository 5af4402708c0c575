"""The roles of logical tensors: what each tensor of a checkpoint is to the model and its optimizer.

Defined once here; the index validates against :data:`ROLES`, placement splits :data:`ZERO_ROLES` over the
(expert-)data-parallel group, the optimizer keeps :data:`OPTIMIZER_ROLES`, a resume restores
:data:`TRAINING_ROLES`.
"""

from __future__ import annotations

#: a model weight.
PARAM = "param"
#: the fp32 master copy of a parameter kept by the optimizer (only for parameters that are not fp32).
MASTER = "master"
#: AdamW's first moment.
EXP_AVG = "exp_avg"
#: AdamW's second moment.
EXP_AVG_SQ = "exp_avg_sq"
#: Muon's momentum buffer.
MOMENTUM = "momentum"
#: any other tensor of the model's state (not trained, replicated like a parameter).
BUFFER = "buffer"

#: every role the index accepts, in the order the format documents them.
ROLES = (PARAM, MASTER, EXP_AVG, EXP_AVG_SQ, MOMENTUM, BUFFER)
#: AdamW's moments, kept for every parameter AdamW steps.
MOMENT_ROLES = (EXP_AVG, EXP_AVG_SQ)
#: Muon's state, kept for every matrix Muon steps.
MUON_ROLES = (MOMENTUM,)
#: the optimizer's state: the masters, AdamW's moments and Muon's momentum.
OPTIMIZER_ROLES = (MASTER, *MOMENT_ROLES, *MUON_ROLES)
#: roles whose tensors ZeRO-1 splits along dim 0 across the (expert-)data-parallel group.
ZERO_ROLES = frozenset(OPTIMIZER_ROLES)
#: what a training run saves and restores: parameters and the optimizer's state.
TRAINING_ROLES = (PARAM, *OPTIMIZER_ROLES)
#: what a run that starts its optimizer afresh restores: the weights (parameters and fp32 masters).
WEIGHT_ROLES = (PARAM, MASTER)
