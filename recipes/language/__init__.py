"""The recipe language: typed config sections loaded strictly from YAML and ``key=value`` overrides
(:mod:`.config`), the roles every recipe declares once (:mod:`.roles`), the lifecycle every recipe shares
(:mod:`.lifecycle`), the planner glue (:mod:`.plans`), other recipes run as steps (:mod:`.steps`), the launcher and
the ``multiengine`` command (:mod:`.launcher`, :mod:`.cli`). It knows no recipe by name: a recipe is a module of the
recipes package whose ``RECIPE`` is a :class:`~.lifecycle.Recipe` subclass. Importing this package imports nothing.
"""
