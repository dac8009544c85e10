"""The look of the panel and the picker, in JupyterLab's own CSS variables so light and dark themes both read well.

A `<style>` block travels in the first HTML widget of each; its rules are scoped to aibro-nb-* classes (the
sidebar has its own aibro-* names)."""

from __future__ import annotations


def text_class(kind: str) -> str:
    """The class of a message's text by kind (ok, warn, error): a theme colour that reads on light and dark."""
    if kind not in ("ok", "warn", "error"):
        raise ValueError(f"kind must be ok, warn or error, not {kind!r}")
    return f"aibro-nb-text-{kind}"


SCROLL_ROWS = 8  # the rows a table's scroll box (.aibro-nb-scroll) shows whole; a longer table scrolls and says so
ROW_PX, HEAD_PX = 25, 29  # a table row (20 px lines, padding, border) and its head, set below for every theme
SCROLL_PX = HEAD_PX + round((SCROLL_ROWS + 0.5) * ROW_PX)  # the head, the rows shown, and half of the next one

STYLE = """<style>
.aibro-nb-panel, .aibro-nb-picker { color: var(--jp-ui-font-color1); font-family: var(--jp-ui-font-family);
  font-size: var(--jp-ui-font-size1); }
.aibro-nb-header { font-size: var(--jp-ui-font-size2); padding: 2px 0; }
.aibro-nb-banner { padding: 4px 8px; border-left: 4px solid; border-radius: 2px; margin: 2px 0;
  background: var(--jp-layout-color2); line-height: 1.4; white-space: normal; }
.aibro-nb-final { padding: 4px 8px; border-left: 4px solid; background: var(--jp-layout-color2); margin: 2px 0; }
.aibro-nb-running { border-color: var(--jp-brand-color1); }
.aibro-nb-ok { border-color: var(--jp-success-color1); }
.aibro-nb-warn { border-color: var(--jp-warn-color1); }
.aibro-nb-error { border-color: var(--jp-error-color1); color: var(--jp-error-color1); }
.aibro-nb-stepper { white-space: nowrap; overflow-x: auto; font-size: var(--jp-ui-font-size0); }
.aibro-nb-step-done, .aibro-nb-text-ok { color: var(--jp-success-color1); }
.aibro-nb-text-warn { color: var(--jp-warn-color1); }
.aibro-nb-text-error { color: var(--jp-error-color1); }
[data-jp-theme-light="true"] .aibro-nb-step-done, [data-jp-theme-light="true"] .aibro-nb-text-ok {
  color: var(--jp-success-color0); }
[data-jp-theme-light="true"] .aibro-nb-text-warn { color: var(--jp-warn-color0); }
.aibro-nb-step-now { color: var(--jp-brand-color1); font-weight: bold; }
.aibro-nb-step-todo { color: var(--jp-ui-font-color2); }
.aibro-nb-step-canceled { color: var(--jp-error-color1); font-weight: bold; }
.aibro-nb-caption { color: var(--jp-ui-font-color2); font-size: var(--jp-ui-font-size0); margin: 2px 0; }
.aibro-nb-scroll { max-height: SCROLL_PXpx; overflow-y: auto; border: 1px solid var(--jp-border-color2); }
.aibro-nb-table { border-collapse: collapse; font-family: var(--jp-code-font-family);
  font-size: var(--jp-code-font-size); }
.aibro-nb-table th { position: sticky; top: 0; background: var(--jp-layout-color2); color: var(--jp-ui-font-color1);
  font-weight: 600; text-align: right; padding: 4px 10px; border-bottom: 1px solid var(--jp-border-color1);
  white-space: nowrap; line-height: 20px; }
.aibro-nb-table td { text-align: right; padding: 2px 10px; border-bottom: 1px solid var(--jp-border-color3);
  white-space: nowrap; line-height: 20px; }
.aibro-nb-table td:first-child, .aibro-nb-table th:first-child { text-align: left; }
.aibro-nb-key { margin-right: 12px; white-space: nowrap; }
.aibro-nb-swatch { display: inline-block; width: 14px; height: 3px; margin: 0 4px 3px 0; vertical-align: middle; }
.aibro-nb-legend { align-self: center; }
.aibro-nb-result pre { background: var(--jp-cell-editor-background); color: var(--jp-content-font-color1);
  border: 1px solid var(--jp-border-color2); padding: 4px 8px; margin: 2px 0; white-space: pre-wrap; }
.aibro-nb-grid { display: grid; gap: 0; border: 1px solid var(--jp-border-color2); width: max-content; }
.aibro-nb-grid .aibro-nb-cell { padding: 3px 6px; border-bottom: 1px solid var(--jp-border-color3);
  font-family: var(--jp-code-font-family); font-size: var(--jp-code-font-size); white-space: nowrap;
  color: var(--jp-ui-font-color1); line-height: 26px; }
.aibro-nb-grid .aibro-nb-head { background: var(--jp-layout-color2); }
.aibro-nb-grid .aibro-nb-head button { font-weight: 600; background: transparent; color: var(--jp-ui-font-color1);
  white-space: nowrap; }
.aibro-nb-hint { color: var(--jp-ui-font-color2); }
.aibro-nb-summary { padding: 4px 8px; background: var(--jp-layout-color2);
  border-left: 4px solid var(--jp-brand-color1); }
</style>""".replace("SCROLL_PX", str(SCROLL_PX))
