"""The model check (`flaloop model OP`): does an op's win survive inside one of the target's models?

    spec.py     which model an op is checked in (the mapping, the contract's override): ModelSpec
    session.py  ModelSession: the bench's session with one model cell and a model's warm-up
    band.py     pure: the base's band around its training run, where a candidate's run leaves it
    run.py      plan, measure (worktrees, launcher, session) and finish into a model record
"""
