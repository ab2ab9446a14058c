//! A minimal PNG writer (8-bit RGB, stored deflate blocks) and a line-chart raster
//! for loss curves. Enough for a plot; no compression is attempted.

/// An RGB image.
pub struct Canvas {
    width: usize,
    height: usize,
    pixels: Vec<[u8; 3]>,
}

impl Canvas {
    /// A canvas filled with `background`.
    pub fn new(width: usize, height: usize, background: [u8; 3]) -> Canvas {
        Canvas {
            width,
            height,
            pixels: vec![background; width * height],
        }
    }

    /// Sets one pixel (ignored outside the canvas).
    pub fn set(&mut self, x: i64, y: i64, color: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.width && (y as usize) < self.height {
            self.pixels[y as usize * self.width + x as usize] = color;
        }
    }

    /// A line from `(x0, y0)` to `(x1, y1)`, `thick` pixels wide.
    pub fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), color: [u8; 3], thick: i64) {
        let steps = (x1 - x0).abs().max((y1 - y0).abs()).ceil().max(1.0) as usize;
        for i in 0..=steps {
            let t = i as f64 / steps as f64;
            let (x, y) = (x0 + (x1 - x0) * t, y0 + (y1 - y0) * t);
            for dx in 0..thick {
                for dy in 0..thick {
                    self.set(
                        x.round() as i64 + dx - thick / 2,
                        y.round() as i64 + dy - thick / 2,
                        color,
                    );
                }
            }
        }
    }

    /// Draws `text` (digits, `.`, `-`, `e`, letters of "steplosvaid" are enough for
    /// axis labels) with a 3x5 font scaled by `scale`, its top left at `(x, y)`.
    pub fn text(&mut self, x: i64, y: i64, text: &str, color: [u8; 3], scale: i64) {
        for (i, c) in text.chars().enumerate() {
            let glyph = glyph(c);
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..3 {
                    if bits >> (2 - col) & 1 == 1 {
                        for sy in 0..scale {
                            for sx in 0..scale {
                                self.set(
                                    x + (i as i64 * 4 + col) * scale + sx,
                                    y + row as i64 * scale + sy,
                                    color,
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The image as PNG file bytes.
    pub fn to_png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity((self.width * 3 + 1) * self.height);
        for row in self.pixels.chunks(self.width) {
            raw.push(0); // filter: none
            for p in row {
                raw.extend_from_slice(p);
            }
        }
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        let mut header = Vec::new();
        header.extend_from_slice(&(self.width as u32).to_be_bytes());
        header.extend_from_slice(&(self.height as u32).to_be_bytes());
        header.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB
        chunk(&mut png, b"IHDR", &header);
        chunk(&mut png, b"IDAT", &zlib_stored(&raw));
        chunk(&mut png, b"IEND", &[]);
        png
    }
}

/// 3x5 glyphs, a row per entry, the left pixel the high bit.
fn glyph(c: char) -> [u8; 5] {
    match c.to_ascii_lowercase() {
        '0' => [7, 5, 5, 5, 7],
        '1' => [2, 6, 2, 2, 7],
        '2' => [7, 1, 7, 4, 7],
        '3' => [7, 1, 7, 1, 7],
        '4' => [5, 5, 7, 1, 1],
        '5' => [7, 4, 7, 1, 7],
        '6' => [7, 4, 7, 5, 7],
        '7' => [7, 1, 1, 2, 2],
        '8' => [7, 5, 7, 5, 7],
        '9' => [7, 5, 7, 1, 7],
        '.' => [0, 0, 0, 0, 2],
        '-' => [0, 0, 7, 0, 0],
        'a' => [2, 5, 7, 5, 5],
        'd' => [6, 5, 5, 5, 6],
        'e' => [7, 4, 6, 4, 7],
        'i' => [7, 2, 2, 2, 7],
        'l' => [4, 4, 4, 4, 7],
        'n' => [6, 5, 5, 5, 5],
        'o' => [7, 5, 5, 5, 7],
        'p' => [7, 5, 7, 4, 4],
        'r' => [6, 5, 6, 5, 5],
        's' => [7, 4, 7, 1, 7],
        't' => [7, 2, 2, 2, 2],
        'v' => [5, 5, 5, 5, 2],
        _ => [0; 5],
    }
}

fn chunk(png: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    png.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = png.len();
    png.extend_from_slice(kind);
    png.extend_from_slice(data);
    let crc = crc32(&png[start..]);
    png.extend_from_slice(&crc.to_be_bytes());
}

/// A zlib stream of stored (uncompressed) deflate blocks.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x78, 0x01];
    let blocks: Vec<&[u8]> = data.chunks(65535).collect();
    for (i, block) in blocks.iter().enumerate() {
        out.push(u8::from(i + 1 == blocks.len()));
        let len = block.len() as u16;
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(block);
    }
    if blocks.is_empty() {
        out.extend_from_slice(&[1, 0, 0, 0xff, 0xff]);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &byte in data {
        a = (a + byte as u32) % 65521;
        b = (b + a) % 65521;
    }
    out.extend_from_slice(&((b << 16) | a).to_be_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= byte as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// One curve of a chart: its `(x, y)` points and color.
pub type Series<'a> = (&'a [(f64, f64)], [u8; 3]);

/// A loss-curve chart: each series a colored polyline over the steps, the y axis
/// from 0 to the largest loss, with its top value and the step count written.
pub fn loss_chart(series: &[Series<'_>], width: usize, height: usize) -> Canvas {
    let mut c = Canvas::new(width, height, [255, 255, 255]);
    let (left, right, top, bottom) = (50.0, width as f64 - 16.0, 16.0, height as f64 - 30.0);
    let points = series.iter().flat_map(|s| s.0.iter());
    let max_x = points.clone().map(|p| p.0).fold(1.0, f64::max);
    let max_y = points
        .map(|p| p.1)
        .filter(|y| y.is_finite())
        .fold(0.0, f64::max)
        .max(1e-9);
    let grey = [210, 210, 210];
    for i in 0..=4 {
        let y = top + (bottom - top) * i as f64 / 4.0;
        c.line((left, y), (right, y), grey, 1);
    }
    let black = [0, 0, 0];
    c.line((left, top), (left, bottom), black, 1);
    c.line((left, bottom), (right, bottom), black, 1);
    let at = |(x, y): (f64, f64)| {
        (
            left + (right - left) * x / max_x,
            bottom - (bottom - top) * (y / max_y).clamp(0.0, 1.0),
        )
    };
    for (points, color) in series {
        for w in points.windows(2) {
            c.line(at(w[0]), at(w[1]), *color, 2);
        }
    }
    c.text(4, top as i64 - 4, &format!("{max_y:.2}"), black, 2);
    c.text(4, bottom as i64 - 8, "0", black, 2);
    c.text(
        right as i64 - 60,
        bottom as i64 + 10,
        &format!("{}", max_x as u64),
        black,
        2,
    );
    c.text(left as i64, bottom as i64 + 10, "steps", black, 2);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_png_of_known_checksums() {
        // The CRC of "IEND" with no data is the one every PNG ends with.
        assert_eq!(crc32(b"IEND"), 0xAE42_6082);
        // Adler-32 of "Wikipedia" is 0x11E60398.
        let z = zlib_stored(b"Wikipedia");
        assert_eq!(&z[z.len() - 4..], &0x11E6_0398u32.to_be_bytes());
        assert_eq!(&z[2..7], &[1, 9, 0, 0xf6, 0xff]);
        let png = Canvas::new(3, 2, [1, 2, 3]).to_png();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
        assert!(png.ends_with(&[0xAE, 0x42, 0x60, 0x82]));
    }

    #[test]
    fn the_chart_draws_its_curve() {
        let pts = [(0.0, 2.0), (50.0, 1.0), (100.0, 0.5)];
        let c = loss_chart(&[(&pts, [200, 0, 0])], 320, 200);
        let red = c.pixels.iter().filter(|p| **p == [200, 0, 0]).count();
        assert!(red > 200, "{red} red pixels");
    }
}
