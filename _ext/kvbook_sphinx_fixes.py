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


def setup(app):
    app.connect("html-page-context", _drop_repeated_scripts)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
