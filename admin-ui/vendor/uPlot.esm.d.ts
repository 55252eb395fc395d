// Types of uPlot.esm.js: uPlot's own declarations.
import uPlot from 'uplot';
export default uPlot;
