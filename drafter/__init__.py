"""Drafters behind one interface (drafter.base). The built-in ones (ngram, dflash, dspark)
register themselves when `drafter.base.build_drafter` first needs them, so importing this
package (or drafter.config) stays light."""
