"""GX's Data Docs pages made readable offline: their CDN stylesheets and scripts dropped, a
small stylesheet and script put inline in their place.

GX's page templates load Bootstrap, Bootstrap Table, jQuery, Font Awesome and Vega from CDNs,
and its logo from GX's S3 bucket. Where realloop runs there is often no internet, and none of
these ship in an installed package, so each page gets the few rules its markup needs (grid,
tables, cards, alerts, status icons) and a script of a few lines that stands in for the jQuery
calls GX's own inline scripts make (the "Failed Only" filter) and for Bootstrap's collapse.
Local links are made to point into the site (GX's favicon link is one level short).
"""

from __future__ import annotations

import re

# Bootstrap 4's classes as GX's pages use them, reduced to what keeps them readable.
CSS = """
*{box-sizing:border-box}
body{margin:0;font-family:-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
font-size:.9rem;line-height:1.5;color:#212529;background:#fff}
a{color:#007bff;text-decoration:none}a:hover{text-decoration:underline}
.container-fluid{width:100%;padding:0 15px}.row{display:flex;flex-wrap:wrap;margin:0 -15px}
[class*="col-"]{position:relative;width:100%;padding:0 15px}
@media (min-width:768px){.col-md-2{flex:0 0 16.67%;max-width:16.67%}
.col-md-10{flex:0 0 83.33%;max-width:83.33%}.col-md-4{flex:0 0 33.3%;max-width:33.3%}
.col-md-6{flex:0 0 50%;max-width:50%}.col-md-8{flex:0 0 66.7%;max-width:66.7%}}
.col-12{flex:0 0 100%;max-width:100%}
.navbar{display:flex;align-items:center;padding:.5rem 1rem;border-bottom:1px solid #dee2e6;
background:#fff}.navbar img{height:40px!important}.sticky-top{position:sticky;top:0;z-index:10}
.breadcrumb{display:flex;list-style:none;margin:0 0 0 1rem;padding:.3rem .8rem;background:#e9ecef;
border-radius:.25rem}.breadcrumb-item+.breadcrumb-item::before{content:"/";padding:0 .5rem;
color:#6c757d}.d-flex{display:flex}.align-items-center{align-items:center}
.table{width:100%;margin-bottom:1rem;border-collapse:collapse}
.table td,.table th{padding:.3rem .5rem;border-top:1px solid #dee2e6;vertical-align:top;
text-align:left}.table-bordered td,
.table-bordered th{border:1px solid #dee2e6}.table-responsive{overflow-x:auto}
.card{border:1px solid rgba(0,0,0,.125);border-radius:.25rem;margin-bottom:1rem}
.card-header{padding:.5rem .75rem;background:rgba(0,0,0,.03);
border-bottom:1px solid rgba(0,0,0,.125)}
.card-body{padding:.75rem}.alert{padding:.5rem .75rem;border-radius:.25rem;margin-bottom:.5rem}
.alert-secondary{background:#e2e3e5;color:#383d41}.text-success{color:#28a745}
.text-danger{color:#dc3545}.text-muted{color:#6c757d}.bg-light{background:#f8f9fa}
.badge{display:inline-block;padding:.2em .4em;font-size:75%;border-radius:.25rem;background:#6c757d;
color:#fff}.badge-success,.bg-success{background:#28a745;color:#fff}
.badge-danger,.bg-danger{background:#dc3545;color:#fff}
.btn{display:inline-block;padding:.25rem .5rem;
border:1px solid #007bff;border-radius:.25rem;cursor:pointer;color:#007bff;background:#fff}
.btn.active,.btn-primary.active{background:#007bff;color:#fff}.btn input{display:none}
.nav{list-style:none;padding:0;margin:0}.nav-link{display:block;padding:.2rem .5rem}
.d-none,.modal,.collapse:not(.show){display:none}
@media (min-width:768px){.d-md-inline-flex{display:inline-flex!important}
.d-md-block{display:block!important}}
h1,h2,h3,h4,h5,h6{margin:0 0 .5rem;font-weight:500;line-height:1.2}h3{font-size:1.5rem}
h4{font-size:1.3rem}h5{font-size:1.1rem}h6{font-size:1rem}.m-0{margin:0!important}
.fas,.fa{font-style:normal}.fa-check-circle::before,.fa-check::before{content:"\\2714";color:#28a745}
.fa-times::before,.fa-times-circle::before{content:"\\2718";color:#dc3545}
.fa-exclamation-triangle::before{content:"\\26A0"}.fa-question-circle::before{content:"?"}
code,pre{font-size:85%}pre{white-space:pre-wrap}
"""

# Just enough of jQuery for GX's inline scripts ($(selector|element).parent().each/fadeIn/
# fadeOut), and Bootstrap's data-toggle="collapse" and "buttons".
SCRIPT = """
function $(s){return $all(typeof s==="string"?Array.from(document.querySelectorAll(s)):[s])}
function $all(a){return{
parent:function(){return $all(a.map(function(e){return e.parentElement}).filter(Boolean))},
each:function(f){a.forEach(function(e,i){f(i,e)});return this},
fadeIn:function(){a.forEach(function(e){e.style.display=""});return this},
fadeOut:function(){a.forEach(function(e){e.style.display="none"});return this}}}
document.addEventListener("click",function(ev){
var b=ev.target.closest('[data-toggle="buttons"] .btn');
if(b){b.parentElement.querySelectorAll(".btn").forEach(function(e){e.classList.remove("active")});
b.classList.add("active")}var t=ev.target.closest('[data-toggle="collapse"]');
if(!t)return;ev.preventDefault();var id=(t.getAttribute("data-target")||t.getAttribute("href")||"")
.slice(1);var c=id&&document.getElementById(id);if(c)c.classList.toggle("show")});
"""

_CDN_LINK = re.compile(r"<link\b[^>]*\bhref=\"(?:https?:)?//[^\"]*\"[^>]*>\s*", re.I)
_CDN_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=\"(?:https?:)?//[^\"]*\"[^>]*>\s*</script>\s*", re.I)
_REMOTE_LOGO = re.compile(r"https://great-expectations-web-assets\.[^\"/]*/([\w.-]+)(?:\?[^\"]*)?")
_FAVICON = re.compile(r"href=\"[./]*static/images/favicon\.ico\"")


def offline_page(page: str, root: str) -> str:
    """GX's page without CDN stylesheets and scripts; its logo and favicon from the site's
    `static/images/` (`root`: the way from the page to the site's root, e.g. "../../../../")."""
    page = _CDN_LINK.sub("", page)
    page = _CDN_SCRIPT.sub("", page)
    page = _REMOTE_LOGO.sub(lambda m: f"{root}static/images/{m.group(1)}", page)
    page = _FAVICON.sub(f'href="{root}static/images/favicon.ico"', page)
    inline = f"<style>{CSS}</style>\n<script>{SCRIPT}</script>\n"
    return page.replace("</head>", inline + "</head>", 1)
