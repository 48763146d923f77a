"""Sphinx 7.4 renders an inline script that an extension registers after the builder started (sphinx-thebe's
`const THEBE_JS_URL = ...`) twice, so every page throws "Identifier 'THEBE_JS_URL' has already been declared".
Keep the first copy of each script."""


def _drop_repeated_scripts(app, pagename, templatename, context, doctree):
    seen, unique = set(), []
    for script in context.get("script_files", []):
        key = (script.filename or "", script.priority, tuple(sorted(script.attributes.items())))
        if key not in seen:
            seen.add(key)
            unique.append(script)
    context["script_files"] = unique


def _run_substitutions(app, config):
    """{{ run_machine }} and {{ run_sitting }} in the book's pages: the canonical run's stamp, which
    scripts/run_chapters.py writes into every notebook's metadata (the first chapter's is read), never prose."""
    import json
    from pathlib import Path

    notebook = json.loads((Path(app.srcdir) / "chapters" / "01_pipeline.ipynb").read_text(encoding="utf-8"))
    stamp = notebook.get("metadata", {}).get("kvbook", {})
    config.myst_substitutions = {**config.myst_substitutions,
                                 "run_machine": stamp.get("machine", "(no canonical run recorded)"),
                                 "run_sitting": stamp.get("sitting", "")}


def setup(app):
    app.connect("config-inited", _run_substitutions)
    app.connect("html-page-context", _drop_repeated_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
