"""What several doctors share: tensor statistics and format ranges, module attribution,
finding display and order, and the low-precision speed check."""
