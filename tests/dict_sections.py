"""Attribute-style edits of a plain nested dict, for tests that parametrize config edits as
`lambda c: c.section.update({...})` over a `to_dict()` copy."""


class DictSections:

  def __init__(self, d: dict):
    self._d = d

  def __getattr__(self, name):
    return DictSections(self._d[name])

  def update(self, values: dict):
    self._d.update(values)
