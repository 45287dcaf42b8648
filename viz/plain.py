"""Figures built as plain dicts in Plotly's JSON schema, wrapped in a ``go.Figure`` without validation.

Why: a step of the Playground draws six figures; building them through Plotly's object model (``go.Scatter``,
``fig.add_shape``, ``fig.update_layout``: every property validated and copied on the way in) cost ~76 ms per
step on this 2-core machine, ten times the figures' own data work, and a class server steps many labs at once
(issue 16's load goals). A figure whose traces and layout are dicts (``figure``: a ``PlainFigure``, whose
Plotly objects are built only if something reads them) costs 0.1-0.6 ms to make and 0.3-0.7 ms to copy and
encode as ``st.plotly_chart`` does (the "batch" preset at step 12: 6 figures, 78 ms before in all), and is the
same figure: ``fig.to_dict()``, ``to_json``, kaleido and attribute reads
(``fig.data[0].x``, ``fig.layout.shapes``) work as before.

What validation no longer catches at run time (a misspelt property would be silently ignored by plotly.js)
is caught by ``validated``, which the tests call on every figure of every preset (tests/test_viz_plain.py).
Dicts here use nested keys only: Plotly's "magic underscore" shorthand (``xaxis_range``) is expanded by
validation alone, so write ``{"xaxis": {"range": ...}}``.
"""

from __future__ import annotations

import pickle

import plotly.graph_objects as go


class PlainFigure(go.Figure):
    """A ``go.Figure`` made from a plain spec dict, with Plotly's object model built only when first needed.

    ``st.plotly_chart`` needs only ``to_dict``, which here is a pickle round trip (a deep copy in C) of the
    spec plus the default template Plotly's constructor would add. ``go.Figure(spec, _validate=False)`` alone
    deep-copies every trace and the layout twice and wraps each property (~5 ms a figure), and Plotly's
    ``to_dict`` deep-copies again and walks the result for numpy arrays (``convert_to_base64``; a plain spec
    holds lists, numbers and strings only): together most of a chart's cost on a busy class server.

    Any other use (``fig.data``, ``fig.layout``, ``update_layout``, ``fig["layout"]``...) first builds the
    ordinary figure from the spec (``__getattr__`` runs when an attribute is missing, whoever asks) and from
    then on ``to_dict`` copies its current content, changes included. tests/test_viz_plain.py checks that
    ``to_dict`` equals Plotly's own for every figure of every preset."""

    def __init__(self, spec: dict):  # not go.Figure.__init__: see the class docstring
        self.__dict__["_plain_spec"] = spec

    def __getattr__(self, name: str):
        spec = self.__dict__.pop("_plain_spec", None)
        if spec is None:  # built already (or being built): a missing attribute is missing
            raise AttributeError(name)
        go.Figure.__init__(self, spec, _validate=False)
        return getattr(self, name)

    def __reduce__(self):  # copy.deepcopy and pickle: the same figure, from its dict
        return PlainFigure, (self.to_dict(),)

    def to_dict(self) -> dict:
        spec = self.__dict__.get("_plain_spec")
        if spec is None:
            spec = {"data": self._data, "layout": self._layout}
            frames = [frame._props for frame in self._frame_objs]
            if frames:
                spec["frames"] = frames
            return _copy(spec)
        res = _copy(spec)
        if res["layout"].get("template") is None and (template := _default_template()) is not None:
            res["layout"]["template"] = _copy(template)  # as go.Figure's constructor sets it
        return res


def _copy(obj):
    """A deep copy of JSON-like data (dicts, lists, str, numbers), in C."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


_TEMPLATES: dict = {}


def _default_template() -> dict | None:
    """Plotly's default template (``plotly.io.templates.default``) as the dict its figures carry."""
    import plotly.io as pio

    default = pio.templates.default
    if default is None:
        return None
    key = default if isinstance(default, str) else id(default)
    if key not in _TEMPLATES:
        template = pio.templates[default] if isinstance(default, str) else default
        _TEMPLATES[key] = go.Figure(layout={"template": template}).to_dict()["layout"]["template"]
    return _TEMPLATES[key]


def figure(data: list[dict], layout: dict, frames: list[dict] | None = None) -> go.Figure:
    """A ``go.Figure`` of ``data`` (trace dicts, each with its ``"type"``: "scatter", "heatmap", "bar", ...)
    and ``layout`` (a layout dict), not validated (see the module docstring). ``frames``: animation frames
    (dicts with ``name``, ``data``, ``layout``) for an exported player."""
    spec = {"data": data, "layout": layout}
    if frames:
        spec["frames"] = frames
    return PlainFigure(spec)


def validated(fig: go.Figure) -> go.Figure:
    """The same figure rebuilt with Plotly's validation: raises ``ValueError`` naming the first invalid
    property or value (for tests: a figure from ``figure`` is only as valid as the dicts it was given)."""
    return go.Figure(go.Figure.to_dict(fig))  # Plotly's own to_dict, not PlainFigure's
