// The book's few additions to sphinx-book-theme (site/conf.py).

// The widget manager loads its icon fonts from beside its own module (site/vendor.py put
// them in _static/html-manager/), which RequireJS would otherwise place under the page's
// folder. Its bundled modules (@jupyter-widgets/base, /controls, ...) also take their asset
// path from their own module URL, so every @jupyter-widgets module maps there too (RequireJS
// picks the longest matching prefix). A global `require` object defined before require.js
// loads is its configuration.
const bookStatic = new URL(".", document.currentScript.src).href;
window.__jupyter_widgets_assets_path__ = bookStatic + "html-manager/";
window.require = {paths: {"@jupyter-widgets/html-manager/dist": bookStatic + "html-manager",
                          "@jupyter-widgets": bookStatic + "html-manager"}};

// The phone drawers. pydata-sphinx-theme wires only the first .primary-toggle and the first
// .secondary-toggle it finds (issue #2451), which sphinx-book-theme keeps hidden; the visible
// buttons in the article header then do nothing. Forward their clicks to the wired ones.
document.addEventListener("DOMContentLoaded", () => {
  for (const kind of ["primary-toggle", "secondary-toggle"]) {
    const [wired, ...rest] = document.querySelectorAll(`button.${kind}`);
    for (const button of rest) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        wired.click();
      });
    }
  }
});
